"""An OpenAI-compatible HTTP front end over the decoder's gRPC API (`mmserve gateway`).

Any OpenAI client (the official SDKs, UIs, tools) talks to a pair unchanged: POST /v1/chat/completions
and /v1/completions become DecoderService.Generate calls, balanced over one or more decoders.
"""
