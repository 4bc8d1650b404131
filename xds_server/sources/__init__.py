"""Where inputs come from: the routing config (file; later ConfigMap) and, later, pods."""
