"""The embedded inference engine: ``python -m miles.engine`` speaks SGLang's HTTP protocol on CPU and GPU.

Modules: ``protocol`` (request structs), ``sampling``, ``model_runner`` (forward + KV cache; ``runner_options``,
``native_lm``, ``native_decode``, ``native_layers``, ``generic_lm``), ``scheduler`` (continuous batching; ``req``,
``admission``, ``retraction``, ``decode_step``), ``weights`` (weight-update receive side), ``engine`` (facade),
``server`` (aiohttp routes), ``__main__`` (CLI), ``testing`` (a server child process and a tiny model for
tests and benchmarks). See docs/engine-protocol.md.
"""
