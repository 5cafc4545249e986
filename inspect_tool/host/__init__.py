"""What this host has to give: its memory, and whether it has a TPU (`accelerator`)."""
