"""The workflow API and what runs a workflow: the registry of runs, one run's dataflow
execution, its deadline, cascades and contract checks, the durable event log, the
compiler's plan for the proxy's backends, progress, and workflows inferred from plain
OpenAI traffic.
"""
