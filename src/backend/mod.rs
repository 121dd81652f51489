//! [`Store`](crate::Store) on shared engines, each behind its own feature: `redis` (Redis
//! and Redis Cluster) and `postgres` (PostgreSQL, with the transactional inbox and
//! outbox).

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
