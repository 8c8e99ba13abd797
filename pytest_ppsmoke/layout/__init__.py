"""The layout report: a measured grid per phase (prompt length x stage count x wire x network), a
fitted cost model (per link: latency plus bytes over bandwidth; per block: compute per phase), and
predictions of time to first token, time per output token and cost per token before renting."""
