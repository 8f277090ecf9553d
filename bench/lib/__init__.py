"""What the benchmark commands in ``bench/`` share.

``models``: the benchmark model, built once under ``.run/bench/models``; ``modes``: what each
side-by-side mode configures (no connector, KVLens per tier, vLLM's ExampleConnector, LMCache
in its multiprocess mode); ``servers``: vLLM servers (and LMCache's server) in their own process
groups with bounded waits; ``client``: HTTP requests and their timings; ``report``: statistics,
the printed table, the JSON file and the PNG plot; ``runner``: the command-line options every
benchmark shares and the loop that starts the modes' servers and measures them side by side.
"""
