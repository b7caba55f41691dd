"""The planner: which memory/sharding configuration trains fastest on this hardware, and what the run will cost.

`space` enumerates the candidates, `memory` prunes and seeds them analytically, `probe` (one launch per candidate)
searches the micro-batch and times real optimizer steps through the recipes' own loop, `cost` turns step times
into days and dollars, `emit` writes the winner's launch configs, `sweep` ties them together with a cache.
"""
