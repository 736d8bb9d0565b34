"""Getting answers to clients: waits, token streams, move announcements, webhooks and the SSRF
guard their URLs pass."""
