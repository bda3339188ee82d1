"""Each device's side of a step run over a ``device_map`` (placed by ``techniques/device_map.py``, run
by ``techniques/dispatch.py``).

The trace tags every storage with its device; here the log is split by device and each GPU's side is
replayed through the caching allocator under its card, the host's side counted as host RAM, and what
sits on disk counted apart. The report is the GPU that needs the most; every device is listed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.accounting.replay import LedgerView, replay
from memfit.estimator.verdict import cuda_fit
from memfit.estimator.fake import build_fake, fake_copy, quiet_fake_log
from memfit.techniques.device_map import HOST_SIDES, place
from memfit.techniques.lora import lora_plan, prepare_lora
from memfit.techniques.precision import weight_dtype
from memfit.units import format_size

__all__ = ["placed_sides", "placement_of", "on_one_gpu", "DISK_BANDWIDTH"]

# Assumed read bandwidth of an offload folder on an NVMe drive (bytes/s); a page-cached read is faster.
DISK_BANDWIDTH = 3e9


def placed_sides(ledger, scratch, placer, gpu, budget, outside: int | None = None):
    """(the highest GPU's view of the log, report fields for every device); ``outside``: the bytes each GPU's
    process share holds outside the allocator (default a training process's)."""
    outside = gpu.outside_bytes if outside is None else outside
    placement = placer.placement
    sides: dict[str, set[int]] = {d: set() for d in placement.devices}
    for index, record in enumerate(ledger.records):
        sides.setdefault(record.device or placement.main, set()).add(index)
    devices, top, top_need = [], None, -1
    entries = placement.entries
    for device in placement.devices:
        view = LedgerView(ledger, sides[device], spikes=device == placement.main)
        counted = replay(view, scratch if device == placement.main else [0] * len(ledger.sites))
        row = {"device": device if device in HOST_SIDES else f"cuda:{device}", "peak_bytes": counted.peak_bytes,
               "by_category": counted.by_category,
               "modules": [name or "(all)" for name, d in entries.items() if str(d) == device]}
        if device == "disk":
            row["peak_bytes"] = sum(ledger.records[i].nbytes for i in sides[device])
        elif device not in HOST_SIDES:
            verdict = cuda_fit(view, gpu, budget, outside=outside)
            fields = verdict.report_fields()
            row.update(peak_bytes=fields["peak_bytes"], reserved_bytes=fields["reserved_bytes"],
                       device_bytes=fields["reserved_bytes"] + outside, verdict=fields["verdict"],
                       missing_bytes=fields.get("missing_bytes"))
            need = row["device_bytes"] + (fields.get("missing_bytes") or 0)
            if need > top_need:
                top, top_need = (device, view), need
        devices.append(row)
    host = next((r for r in devices if r["device"] == "cpu"), None)
    disk = next((r for r in devices if r["device"] == "disk"), None)
    top_device, view = top
    notes = [f"device_map ({placement.strategy}) over {placement.gpus} GPU(s): "
             + ", ".join(f"{r['device']} {format_size(r.get('device_bytes', r['peak_bytes']))}" for r in devices)
             + f"; the report is cuda:{top_device}'s, every device in report.devices"]
    if placer.copied_bytes:
        link = gpu.host_link_bandwidth
        per_step, from_disk = placer.copied_bytes / _steps(ledger), placer.copied_from_disk / _steps(ledger)
        seconds = (per_step - from_disk) / link + from_disk / DISK_BANDWIDTH
        notes.append(f"offloaded layers: {format_size(per_step)} of weights copied to cuda:{placement.main} each step "
                     f"(each forward, and each recomputation), about {seconds:.2f} s a step over the "
                     f"{gpu.host_link} ({link / 1e9:.0f} GB/s)"
                     + (f" and the disk (assumed {DISK_BANDWIDTH / 1e9:.0f} GB/s)" if placer.copied_from_disk else ""))
    fields = {"devices": devices, "device_map": placement.to_dict() | {"reported": f"cuda:{top_device}"},
              "host_bytes": host["peak_bytes"] if host else None,
              "disk_bytes": disk["peak_bytes"] if disk else None, "notes": notes}
    return view, fields


def _steps(ledger) -> int:
    return max(1, len({step for phase, step in ledger.marks if phase == "optimizer"}))


def placement_of(source, recipe, request: dict, gpu):
    """The ``Placement`` from_pretrained would make of ``source`` under ``request`` (``place``'s
    arguments): on a fake copy of the model as the step will load it (weight dtype, a QLoRA base
    quantised), before any adapter is added."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = weight_dtype(recipe.precision)
    with quiet_fake_log():
        if source.module is not None:
            module = fake_copy(source.module, mode, dtype)
        else:
            module = build_fake(source.build, mode, torch.device("cpu"), dtype)
        with mode:
            prepare_lora(module, recipe)
            return place(module, **request, card=gpu, qlora=lora_plan(recipe.lora)[0] == "qlora")


def on_one_gpu(report, placement):
    """A placement that puts everything on one GPU runs as the plain step does (Accelerate moves the model
    there and adds no hook that moves anything): the report of that step, with the placement beside it."""
    row = {"device": f"cuda:{placement.main}", "peak_bytes": report.peak_bytes, "by_category": report.by_category,
           "modules": ["(all)"], "reserved_bytes": report.reserved_bytes, "device_bytes": report.device_bytes,
           "verdict": report.verdict}
    note = (f"device_map ({placement.strategy}) over {placement.gpus} GPU(s) puts the whole model on "
            f"cuda:{placement.main}: the step runs as on one card")
    return dataclasses.replace(report, devices=[row], device_map=placement.to_dict() | {"reported": row["device"]},
                               notes=report.notes + [note])
