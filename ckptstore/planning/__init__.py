"""Pure planning: what to write and where, as plain data. No file I/O and no process groups here."""
