"""End-to-end attribution: which input tokens drove a prediction (method §7)."""
