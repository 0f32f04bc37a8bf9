"""The torch engine: a continuous-batching scheduler (`engine`) over a slot-KV-cache Llama
forward (`llama`), with its own sampler (`sampling`)."""
