"""Who may do what in the allocator (docs/security.md): the table of method -> roles that
the ``AuthInterceptor`` enforces, and the checks that bind a lease to the tenant that
was granted it and a pool to the worker whose identity names it.

With authentication off (no tokens file and no client CA: a loopback-only development
server), ``caller()`` is None and every check here passes.
"""

from __future__ import annotations

from kvservice import errors
from kvservice.allocator.store import Store
from kvservice.common.auth import Identity, caller

SERVICE = "/kvservice.v1.Allocator/"
TENANT, WORKER, ADMIN = "tenant", "worker", "admin"

#: Method -> the roles that may call it. A lease-bearing call (every tenant method but
#: GrantLease) is then checked against the lease's tenant; a worker's pool calls against
#: its own pool id.
ROLES: dict[str, frozenset[str]] = {SERVICE + method: frozenset(roles) for method, roles in {
    "RegisterPool": (WORKER, ADMIN),
    "Heartbeat": (WORKER, ADMIN),
    "ListPools": (TENANT, WORKER, ADMIN),
    "DescribePool": (TENANT, WORKER, ADMIN),
    "GetPoolStats": (TENANT, ADMIN),
    "GrantLease": (TENANT, ADMIN),
    "KeepAlive": (TENANT, ADMIN),
    "RevokeLease": (TENANT, ADMIN),
    "CreateSequence": (TENANT, ADMIN),
    "Step": (TENANT, ADMIN),
    "ForkSequence": (TENANT, ADMIN),
    "MigrateSequence": (TENANT, ADMIN),
    "DrainPool": (ADMIN,),
    "UnregisterPool": (ADMIN,),
    "FreeSequences": (TENANT, ADMIN),
    "GetSequence": (TENANT, ADMIN),
    "Sync": (TENANT, ADMIN),
    "Audit": (ADMIN,),
    "SettleTiers": (TENANT, WORKER, ADMIN),
}.items()}

#: Lease id -> tenant entries kept (a lease's tenant never changes).
MAX_CACHED = 100_000


class Access:
    """The per-call checks past the role table, for one allocator replica."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._tenants: dict[str, str] = {}

    async def lease(self, lease_id: str) -> None:
        """Lets a call on ``lease_id`` through only for the lease's own tenant (or an admin).

        An unknown lease passes: the call itself answers NOT_FOUND or LEASE_EXPIRED.

        Raises:
            PermissionDenied: the lease is another tenant's.
        """
        ident = caller()
        if ident is None or ident.role == ADMIN:
            return
        tenant = await self._tenant_of(lease_id)
        if tenant is not None and tenant != ident.name:
            raise errors.PermissionDenied(f"the lease named is not a lease of tenant {ident.name}")

    async def sequence(self, lease_id: str) -> None:
        """Lets a read of a sequence held by ``lease_id`` through only for that lease's
        tenant (or an admin); a sequence whose lease is gone is an admin's to see.

        Raises:
            PermissionDenied: the sequence is not the caller's.
        """
        ident = caller()
        if ident is None or ident.role == ADMIN:
            return
        if await self._tenant_of(lease_id) != ident.name:
            raise errors.PermissionDenied(f"the sequence is not held by a lease of tenant {ident.name}")

    async def _tenant_of(self, lease_id: str) -> str | None:
        tenant = self._tenants.get(lease_id)
        if tenant is None:
            tenant = await self.store.lease_tenant(lease_id)
            if tenant is None:
                return None
            if len(self._tenants) >= MAX_CACHED:
                self._tenants.clear()
            self._tenants[lease_id] = tenant
        return tenant

    @staticmethod
    def pool(pool_id: str, what: str) -> None:
        """A worker may name only its own pool (its identity's name).

        Raises:
            PermissionDenied: a worker naming another pool (or none).
        """
        ident = caller()
        if ident is not None and ident.role == WORKER and pool_id != ident.name:
            raise errors.PermissionDenied(f"{what}: worker {ident.name} may only name its own pool "
                                          f"({ident.name}), not {pool_id or '(none: a new id)'}")

    @staticmethod
    def grant_tenant(requested: str) -> str:
        """The tenant a GrantLease is for: the caller's own name for a tenant (naming
        another is refused), the named one for an admin, the request's when nobody is
        authenticated.

        Raises:
            PermissionDenied: a tenant asking for a lease under another tenant's name.
        """
        ident: Identity | None = caller()
        if ident is None or ident.role == ADMIN:
            return requested
        if requested and requested != ident.name:
            raise errors.PermissionDenied(f"tenant {ident.name} may not grant a lease for tenant {requested}: "
                                          f"a lease is the authenticated tenant's (leave tenant empty)")
        return ident.name
