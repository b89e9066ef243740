"""One checkpoint in the format, read and written through storage: the single-file container
(``ckptstore.save``/``load``), sharded directories (``save_sharded``/``load_sharded``, and every
step of every tier), resharding, inspection. Knows nothing of tiers, steps or the pipeline."""
