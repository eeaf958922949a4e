# Model-backed tests share two cores with the engine's workers: run them one at a time.
ExUnit.start(max_cases: 1, timeout: 300_000)
