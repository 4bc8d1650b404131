"""Where inputs come from: the routing config (file or ConfigMap), pods and their metrics."""

from xds_server.sources.config_file import watch_config_file

__all__ = ["watch_config_file"]
