"""OpenAI's shapes on Sluice's requests and jobs: a body mapped to a native one (validated once,
for the front, job lines and batches), answers rendered back, Files and Batches as bulk jobs."""
