"""Qt-free model library: presets catalog, "will it run here?" estimates, hub client, downloads, local models."""
