"""GCP deployment scripts for jaxinfer: TPU VMs, TPU slices, GPU VMs (see deploy/README.md).

Run them from the checkout root: `python -m deploy.tpu_vm ...`, `python -m deploy.tpu_slice
...`, `python -m deploy.gpu_vm ...`; every one takes `--dry_run`. Standard library only; nothing
here imports jaxinfer, so a laptop without JAX can drive a deployment.
"""
