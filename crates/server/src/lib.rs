//! The ds4 server: HTTP API and KV reuse (see issue: ds4-server).
