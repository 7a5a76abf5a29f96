"""Accuracy evaluations that run against an OpenAI-compatible server (``gsm8k``)."""
