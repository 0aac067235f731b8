from .llm import LLM, EngineConfig, RequestOutput

__all__ = ["LLM", "EngineConfig", "RequestOutput"]
