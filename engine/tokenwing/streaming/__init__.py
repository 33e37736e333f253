"""Expert streaming: the native core (direct reads, scheduler, RAM expert cache) and its Python face."""
