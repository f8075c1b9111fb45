"""vLLM conformance: kvgate's simulator against vLLM's own V1 scheduler, step by step.

Runs in its own virtualenv (`./scripts/conformance`), which has vLLM; kvgate's main suite
never imports this package.
"""
