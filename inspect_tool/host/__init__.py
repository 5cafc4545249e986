"""What this host has to give: its memory."""
