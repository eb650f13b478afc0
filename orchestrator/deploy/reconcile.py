"""Reconcile: (TreePipeline object, the objects it owns) → actions and status. Pure, no I/O.

The operator (:mod:`orchestrator.deploy.operator`) lists the owned objects, calls
:func:`reconcile` and applies the actions in order.  Everything here is plain data
in, plain data out, so every case (create, update, delete, drift) is testable
without a cluster.

* an object the spec wants and the cluster lacks → ``create`` (a *re*-create, and
  ``Degraded``, when this generation was already reconciled: someone deleted it);
* an object whose ``treepipe.io/hash`` differs from the desired one → ``update`` (the
  spec changed); one whose fields differ from what the operator wrote → ``update``
  and ``Degraded`` (edited by hand);
* an owned object the spec no longer wants (fewer stages, external Redis) → ``delete``;
* the embedded Redis's Secret and the link-keys Secret → ``ensure`` (in
  :attr:`Result.ensure`): create each only if it does not exist.  The operator cannot read
  Secrets, so it cannot observe them; it sends the creates on every pass and an "already
  exists" answer means nothing to do.  The password and the keys are added by the operator
  at that moment, so none passes through here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.deploy.manifest import ManifestError, validate_manifest
from orchestrator.deploy.planner import with_plan
from orchestrator.deploy.render import HASH_ANNOTATION, link_secret, redis_secret, render

Obj = dict[str, Any]
Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Action:
    """One change to make in the cluster."""

    verb: Literal["create", "update", "delete", "ensure"]
    kind: str
    name: str
    namespace: str
    reason: str
    body: Obj | None = None  # the desired object (create/update)
    api_version: str = ""


@dataclass
class Result:
    """What to do, and the status to write on the TreePipeline."""

    actions: list[Action] = field(default_factory=list)
    status: Obj = field(default_factory=dict)
    # create-if-absent, before the actions: objects the operator may create but not read
    ensure: list[Action] = field(default_factory=list)


def _key(o: Obj) -> Key:
    return (o["kind"], o["metadata"]["name"])


def is_subset(want: Any, have: Any) -> bool:
    """True when every field of ``want`` has the same value in ``have``.

    The API server adds defaults (and status) to what the operator wrote; those extra
    fields are not drift.  Lists must have the same length: an added container or port
    is a change.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k])
                                              for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(is_subset(a, b) for a, b in zip(want, have, strict=True)))
    return want == have


def owned(cr: Obj, objs: list[Obj]) -> list[Obj]:
    """The objects controlled by ``cr`` (ownerReference uid), ignoring everything else."""
    uid = cr["metadata"].get("uid")
    return [o for o in objs
            if any(r.get("uid") == uid and r.get("controller")
                   for r in o.get("metadata", {}).get("ownerReferences", []))]


def _workload_ready(o: Obj) -> bool:
    want = o.get("spec", {}).get("replicas", 1)
    st = o.get("status") or {}
    if o["kind"] == "Deployment":
        return st.get("availableReplicas", 0) >= want and st.get("updatedReplicas", 0) >= want
    if o["kind"] == "StatefulSet":
        return st.get("readyReplicas", 0) >= want and st.get("currentReplicas", want) >= want
    return True


def _condition(old: list[Obj], ctype: str, ok: bool, reason: str, message: str,
               generation: int | None, now: str) -> Obj:
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == ctype), None)
    # the transition time moves only when the status flips (Kubernetes convention)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else now
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def reconcile(cr: Obj, observed: list[Obj], now: str) -> Result:
    """Actions that turn ``observed`` into what ``cr``'s spec wants, and the new status.

    ``cr`` is the TreePipeline as stored (metadata with name, namespace, uid and
    generation; spec; status).  ``observed`` are the objects the operator listed; only
    those ``cr`` controls are considered.  ``now`` is an RFC 3339 timestamp.
    """
    meta = cr["metadata"]
    gen = meta.get("generation")
    old_status = cr.get("status") or {}
    old_conds = old_status.get("conditions", [])
    mine = {_key(o): o for o in owned(cr, observed)}

    def status(planned: tuple[bool, str, str], ready: tuple[bool, str, str],
               degraded: tuple[bool, str, str], **extra: Any) -> Obj:
        conds = [_condition(old_conds, t, *v, gen, now)
                 for t, v in (("Planned", planned), ("Ready", ready), ("Degraded", degraded))]
        return {**{k: v for k, v in old_status.items() if k in ("stages", "endpoint")},
                **extra, "observedGeneration": gen, "conditions": conds}

    try:
        origin = f"TreePipeline {meta.get('namespace')}/{meta['name']}"
        m = validate_manifest({"apiVersion": cr.get("apiVersion"), "kind": cr.get("kind"),
                               "metadata": {"name": meta["name"],
                                            "namespace": meta.get("namespace")},
                               "spec": cr.get("spec") or {}}, origin)
        if m.spec.backend != "kubernetes":
            raise ManifestError("spec.backend: is 'local', which `treepipe up` runs on one "
                                "machine; set backend: kubernetes for the operator")
        desired = render(m, owner_uid=meta["uid"], the_plan=with_plan(m, origin).plan)
        secret = redis_secret(m, owner_uid=meta["uid"])
        links = link_secret(m, owner_uid=meta["uid"])
    except ManifestError as e:
        # keep whatever runs: a typo in an edit must not tear down a serving pipeline
        bad = (False, "InvalidSpec", str(e))
        return Result([], status(bad, bad, (bool(mine), "InvalidSpec",
                                            "serving the last valid spec" if mine else "")))

    reconciled_before = old_status.get("observedGeneration") == gen and gen is not None
    actions: list[Action] = []
    drift: list[str] = []
    want = {_key(o): o for o in desired}
    for key, body in want.items():
        have = mine.get(key)
        ns = body["metadata"]["namespace"]
        if have is None:
            why = "deleted outside the operator" if reconciled_before else "new"
            if reconciled_before:
                drift.append(f"{key[0]}/{key[1]} was deleted")
            actions.append(Action("create", key[0], key[1], ns, why, body, body["apiVersion"]))
            continue
        h_want = body["metadata"]["annotations"][HASH_ANNOTATION]
        h_have = have["metadata"].get("annotations", {}).get(HASH_ANNOTATION)
        if h_have != h_want:
            actions.append(Action("update", key[0], key[1], ns, "spec changed", body,
                                  body["apiVersion"]))
        elif not is_subset(body, have):
            drift.append(f"{key[0]}/{key[1]} was edited")
            actions.append(Action("update", key[0], key[1], ns, "edited outside the operator",
                                  body, body["apiVersion"]))
    for key, have in mine.items():
        if key not in want:
            actions.append(Action("delete", key[0], key[1], have["metadata"]["namespace"],
                                  "no longer in the spec", None, have["apiVersion"]))

    n_stages = sum(1 for k in want if k[0] == "StatefulSet")
    workloads = [k for k in want if k[0] in ("StatefulSet", "Deployment")]
    untouched = {(a.kind, a.name) for a in actions}
    ready = [k for k in workloads if k not in untouched and k in mine
             and _workload_ready(mine[k])]
    ready_stages = sum(1 for k in ready if k[0] == "StatefulSet")
    waiting = [f"{k[0]}/{k[1]}" for k in workloads if k not in ready]
    all_ready = not waiting
    # a workload that the operator did not just (re)create or change and that is not ready
    unhealthy = [f"{k[0]}/{k[1]} is not ready" for k in workloads
                 if k in mine and k not in untouched and not _workload_ready(mine[k])
                 and reconciled_before]
    problems = drift + unhealthy
    gw = m.spec.gateway
    ns = meta.get("namespace") or "default"
    endpoint = f"{m.metadata.name}-gateway.{ns}.svc:{gw.port}"
    new_status = status(
        (True, "Planned", f"{n_stages} stages, width {m.spec.draft.width}, "
                          f"top-k {m.spec.draft.topk}"),
        (all_ready, "Ready" if all_ready else "Progressing",
         "all components ready" if all_ready else "waiting for " + ", ".join(waiting)),
        (bool(problems), "Drift" if drift else ("Unhealthy" if unhealthy else "AsExpected"),
         "; ".join(problems)),
        stages=n_stages, readyStages=ready_stages, endpoint=endpoint)
    ensure = [] if secret is None else [Action(
        "ensure", "Secret", secret["metadata"]["name"], secret["metadata"]["namespace"],
        "created with a random password if missing, never overwritten", secret, "v1")]
    ensure.append(Action("ensure", "Secret", links["metadata"]["name"],
                         links["metadata"]["namespace"],
                         "created with fresh link keys if missing, never overwritten", links,
                         "v1"))
    return Result(actions, new_status, ensure)


def teardown(cr: Obj, observed: list[Obj]) -> list[Action]:
    """Delete actions for everything ``cr`` owns, workloads before what they mount.

    Kubernetes' garbage collector does the same through ownerReferences; the operator
    runs this too so a deletion does not depend on the collector's timing.
    """
    # the NetworkPolicies last: no pod outlives what protects it
    order = {"Deployment": 0, "StatefulSet": 0, "Service": 1, "ConfigMap": 2,
             "NetworkPolicy": 3}
    objs = sorted(owned(cr, observed), key=lambda o: (order.get(o["kind"], 2), _key(o)))
    return [Action("delete", o["kind"], o["metadata"]["name"], o["metadata"]["namespace"],
                   "pipeline deleted", None, o["apiVersion"]) for o in objs]
