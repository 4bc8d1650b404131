"""Make a stock Envoy balance LLM inference traffic GPU-aware, steered only by xDS."""
