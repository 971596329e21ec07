"""The arguments every fenced helper takes: a fence (a number or a lease), and a resource.

Shared by the gate (``fencing``), the SQL helper (``_fence_sql``) and the Redis helpers
(``_fence_redis``): the fence validated, and the resource whose grants ``store=`` checks.
"""

from __future__ import annotations

from ._errors import LeaseConfigError
from ._lease import Lease
from ._names import validate_fence, validate_resource

__all__ = ["fence_of", "resource_of"]


def fence_of(fence: int | Lease) -> int:
    """The fence given (or the lease's), validated."""
    return validate_fence(fence.fence if isinstance(fence, Lease) else fence, fence)


def resource_of(helper: str, fence: int | Lease, resource: str | None) -> str:
    """The lease resource whose granted fences a helper given ``store=`` checks."""
    if resource is None:
        if not isinstance(fence, Lease):
            raise LeaseConfigError(
                f"{helper}(store=...) checks the fences the store granted for a resource: pass "
                "the lease itself as the fence, or name its resource with resource="
            )
        return fence.resource
    validate_resource(resource)
    if isinstance(fence, Lease) and fence.resource != resource:
        raise LeaseConfigError(
            f"{helper}: resource={resource!r} is not the lease's resource "
            f"{fence.resource!r}; a fence orders the holders of its own resource only"
        )
    return resource
