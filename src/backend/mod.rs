//! [`Store`](crate::Store) on shared engines, each behind its own feature: `redis` (Redis
//! and Redis Cluster).

#[cfg(feature = "redis")]
pub(crate) mod redis;
