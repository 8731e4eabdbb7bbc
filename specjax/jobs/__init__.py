"""Work made of many calls of the engine: batch jobs (resumable, sharded), continuous
batching's slots and segments, and saved prompt slots. Imports `decode` and below."""
