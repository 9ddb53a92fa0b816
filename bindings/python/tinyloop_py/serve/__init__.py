"""TinyLoop on Ray Serve: engine replicas behind the OpenAI-compatible API of ``tinyloop MODEL
serve``, routed by prompt prefix (docs/DEPLOY.md).

    pip install "tinyloop_py[serve]"
    serve run tinyloop_py.serve:app model=models/demo.tinyloop replicas=2 device=cpu

Importing this module imports Ray; ``import tinyloop_py`` does not.
"""

from .app import (EngineDeployment, IngressDeployment, OpenAIIngress, Options, TinyLoopEngine,
                  app, build)
from .router import PrefixRouter

__all__ = [
    "app",
    "build",
    "Options",
    "TinyLoopEngine",
    "OpenAIIngress",
    "EngineDeployment",
    "IngressDeployment",
    "PrefixRouter",
]
