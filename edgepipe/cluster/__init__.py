"""The running system: coordinator and worker, thin asyncio shells around runtime and plan."""
