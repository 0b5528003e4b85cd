"""Launch settings of the real engines that docker-compose and the tests run behind the
gateway: llama.cpp (llamacpp.py, CPU, tests) and vLLM (vllm.Dockerfile, compose's gpu profile)."""
