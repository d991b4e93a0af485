//! The admin login of the commands that create or remove schema objects, from the command line
//! or the environment.

use clap::Args;

use crate::db::AdminLogin;

/// `--admin-url` (or `OUTBOX_SETUP_URL`) and `--admin-password-env`.
///
/// Give the admin login through the environment, not the command line: arguments are visible
/// to every user of the machine (`ps`, /proc/PID/cmdline) and land in shell history.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Run as this login (an owner or superuser) instead of the source's `url`. Prefer the
    /// OUTBOX_SETUP_URL variable: a password here is visible in the process list.
    #[arg(long, env = "OUTBOX_SETUP_URL", hide_env_values = true)]
    pub admin_url: Option<String>,
    /// Read the admin login's password from this environment variable, so that --admin-url
    /// (or OUTBOX_SETUP_URL) needs none.
    #[arg(long, value_name = "VAR")]
    pub admin_password_env: Option<String>,
}

/// The password read from `--admin-password-env`, kept while an [`AdminLogin`] borrows it.
#[derive(Debug)]
pub struct AdminSecret {
    url: Option<String>,
    password: Option<String>,
}

impl AdminArgs {
    /// Reads the password variable; an unset variable, or a password without a URL, is an error
    /// naming the flag.
    pub fn resolve(&self) -> anyhow::Result<AdminSecret> {
        let password = match &self.admin_password_env {
            Some(var) => Some(
                std::env::var(var)
                    .map_err(|_| anyhow::anyhow!("--admin-password-env: the environment variable {var} is not set"))?,
            ),
            None => None,
        };
        if self.admin_url.is_none() && password.is_some() {
            anyhow::bail!("--admin-password-env needs the admin login's URL: --admin-url or OUTBOX_SETUP_URL");
        }
        Ok(AdminSecret { url: self.admin_url.clone(), password })
    }
}

impl AdminSecret {
    /// The admin login, or `None` to run as each source's own login.
    pub(crate) fn login(&self) -> Option<AdminLogin<'_>> {
        self.url.as_deref().map(|url| AdminLogin { url, password: self.password.as_deref() })
    }
}
