//! Absurd numbers on kvctl's command line: refused naming the option, or (where the type allows
//! any value) handled without a panic, against a live service.

use kvshm::manager::CacheConfig;
use kvshm::service::{Service, ServiceConfig};

use crate::support::*;

#[test]
fn timeouts_that_are_no_duration_are_refused_naming_the_option() {
    for timeout in ["1e300s", "-1", "nan", "inf", "1e300ms", "18446744073709551615", "soon"] {
        let option = format!("--timeout={timeout}");
        kvctl(&[&option, "ls"]).assert_fails_saying(&["--timeout", timeout]);
    }
}

#[test]
fn the_largest_depth_and_a_century_long_timeout_work_against_a_live_service() {
    let name = unique_name("arguments");
    let _cleanup = Cleanup(name.clone());
    let cache = CacheConfig::new(16, 64);
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, 1024)).unwrap();
    let century = (100u64 * 365 * 24 * 3600).to_string();
    let args = ["tree", name.as_str(), "--depth", "4294967295", "--timeout", &century, "--json"];
    let tree = kvctl_while(&args, || service.poll()).assert_ok().json();
    assert_eq!(tree["total_nodes"], 0);
    kvctl(&["tree", name.as_str(), "--depth=-1"]).assert_fails_saying(&["-1"]);
}
