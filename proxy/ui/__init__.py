"""The proxy's pages (``/ui``): a run's timeline, the compile page, and their static files.
"""
