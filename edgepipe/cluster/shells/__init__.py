"""The coordinator's thin asyncio shells: connections, steps, requests, deployer, migration,
checkpoints, calibration, links, the prefix cache, drafting, variants, views. They carry out what
``rules`` decide and feed what happens back as events."""
