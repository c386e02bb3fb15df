"""tierproxy: tiered, fair, priority-aware proxy and scheduler plugin for stock vLLM."""
