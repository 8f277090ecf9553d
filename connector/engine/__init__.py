"""Pure KVLens logic: keys, index, pins, trackers and planning. Imports neither vLLM nor torch,
and nothing of connector/ outside this package."""
