//! Against a live `kvshm::service::Service` (added once the service lands on main).
