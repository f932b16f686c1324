//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod clock;
pub mod disk;
pub mod download;
pub mod logging;
pub mod paths;
pub mod warm;

/// Every argument of `cmd` and its subcommands that has no help text, as
/// "command --flag" (#19 item 4: every flag of every binary has `--help` text).
pub fn args_without_help(cmd: &clap::Command) -> Vec<String> {
    let mut out = Vec::new();
    for a in cmd.get_arguments() {
        let builtin = matches!(a.get_id().as_str(), "help" | "version");
        if a.get_help().is_none() && a.get_long_help().is_none() && !builtin {
            out.push(format!("{} {}", cmd.get_name(), a.get_id()));
        }
    }
    for sub in cmd.get_subcommands() {
        out.extend(args_without_help(sub));
    }
    out
}

/// A unit test asserting [`args_without_help`] is empty for the clap parser `$cli`.
#[macro_export]
macro_rules! every_argument_has_help_text {
    ($cli:ty) => {
        #[cfg(test)]
        #[test]
        fn every_argument_has_help_text() {
            use clap::CommandFactory;
            let missing = $crate::args_without_help(&<$cli>::command());
            assert_eq!(missing, Vec::<String>::new());
        }
    };
}
