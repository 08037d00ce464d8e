"""The single-controller layer: worker classes mark methods with
``@register(Dispatch...)``; a :class:`WorkerGroup` places ``world_size``
instances of one class on a :class:`ResourcePool` (under the ``local`` or the
``ray`` backend) and exposes each marked method as one driver-side call.

Ray is imported only when the ``ray`` backend (or :func:`init_ray`) is used.
"""

from hybridrl.controller.dispatch import Dispatch, register, registered_methods
from hybridrl.controller.health import CallTimeoutError
from hybridrl.controller.ray_backend import init_ray
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.worker import Worker, WorkerContext, WorkerDiedError, WorkerError
from hybridrl.controller.worker_group import WorkerGroup

__all__ = [
    "CallTimeoutError",
    "Dispatch",
    "register",
    "registered_methods",
    "ResourcePool",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "init_ray",
]
