"""``python -m tools.configdoc``: docs/config.md, generated from the config dataclasses."""
