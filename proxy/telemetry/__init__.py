"""The proxy's traces and metrics: workflow-run spans and Prometheus metrics, and one span
per OpenAI API request.
"""
