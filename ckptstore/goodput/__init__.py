"""Goodput: how often to checkpoint, what failures cost, and what a run actually achieved.

planner.py   Young's and Daly's optimal intervals and the exact expected waste under exponential failures
simulate.py  Monte Carlo of a long job with tiers, failure classes and async persistence (numpy, vectorised)
events.py    the store's append-only event log and the goodput accounting read back from it
"""
