"""Server replicas share what their Envoys report, so every replica decides from the whole
fleet's load: each streams its own Envoys' load summary to the others (service.py), keeps a
link to every peer (links.py), and finds its peers from a static list or the Kubernetes API
(kubernetes_peers.py)."""

__all__: list[str] = []
