"""The host backend: the EP protocols run by the calling CPU thread (engine.py) over a Channel."""
