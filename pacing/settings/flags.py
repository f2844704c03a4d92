"""The command-line flag of every pacing setting (the store's flags are in
``pacing.settings.store``), the tables from settings fields to their flags, and
the values the flags share with the settings objects.

Names only, no logic and no imports: the parser, the checks and the settings
objects all take a flag's name from here, so every error names the flag the
operator typed.
"""

from __future__ import annotations

DEFAULT_RATE_FLAG = "--default-user-output-tokens-per-second"
USER_RATES_FLAG = "--user-output-tokens-per-second"
MODE_FLAG = "--output-rate-mode"
TIERS_FLAG = "--output-rate-tiers"
TIER_MEMBERS_FLAG = "--output-rate-tier-members"
TEAMS_FLAG = "--output-rate-teams"
TEAM_MEMBERS_FLAG = "--output-rate-team-members"
EXEMPT_USERS_FLAG = "--output-rate-exempt-users"
EXEMPT_TIERS_FLAG = "--output-rate-exempt-tiers"
USER_SOURCE_FLAG = "--output-rate-user-source"
TEAM_SOURCE_FLAG = "--output-rate-team-source"
REQUIRE_USER_FLAG = "--output-rate-require-user"
ALLOW_UNATTRIBUTED_FLAG = "--output-rate-allow-unattributed-routes"
FAIR_SHARE_FLAG = "--output-rate-fair-share"
WEIGHTS_FLAG = "--output-rate-weights"
FAIR_SHARE_CONFIG_FLAG = "--output-rate-fair-share-config"
ADDRESS_FLAG = "--output-rate-control-address"
CONFIG_FLAG = "--user-output-rate-config"
TOKEN_FILE_FLAG = "--output-rate-control-token-file"
TLS_CERT_FLAG = "--output-rate-control-tls-cert"
TLS_KEY_FLAG = "--output-rate-control-tls-key"
TLS_CLIENT_CA_FLAG = "--output-rate-control-tls-client-ca"
POLICY_FLAG = "--output-rate-policy"

#: Where the control plane listens unless told otherwise: loopback only.
DEFAULT_ADDRESS = "127.0.0.1:50151"
#: ``--output-rate-control-address`` value that runs no control plane.
ADDRESS_OFF = "off"
#: Environment variable holding the control plane's bearer token when no token
#: file is given (read by the control plane and by ``output-rate-ctl``).
TOKEN_ENV = "OUTPUT_RATE_CONTROL_TOKEN"

#: ``OutputRateSettings`` field -> the flag that sets it.
SETTING_FLAGS = {
    "policy": POLICY_FLAG,
    "user_source": USER_SOURCE_FLAG,
    "team_source": TEAM_SOURCE_FLAG,
    "require_user": REQUIRE_USER_FLAG,
    "allow_unattributed": ALLOW_UNATTRIBUTED_FLAG,
    "fair_share_config": FAIR_SHARE_CONFIG_FLAG,
}

#: Piece of the start-up policy -> the flag that gives it, an alias of that
#: piece of ``POLICY_FLAG``'s document (``pacing.settings.policy``); the
#: pieces' names are also the older ``additional_config`` keys.
POLICY_ALIASES = {
    "default_rate": DEFAULT_RATE_FLAG,
    "mode": MODE_FLAG,
    "fair_share": FAIR_SHARE_FLAG,
    "user_rates": USER_RATES_FLAG,
    "tier_rates": TIERS_FLAG,
    "memberships": TIER_MEMBERS_FLAG,
    "exempt_users": EXEMPT_USERS_FLAG,
    "exempt_tiers": EXEMPT_TIERS_FLAG,
    "team_rates": TEAMS_FLAG,
    "team_members": TEAM_MEMBERS_FLAG,
    "user_weights": WEIGHTS_FLAG,
    "tier_weights": WEIGHTS_FLAG,
    "team_weights": WEIGHTS_FLAG,
}

#: ``ControlSettings`` field -> its flag.
CONTROL_FLAGS = {
    "address": ADDRESS_FLAG,
    "config_path": CONFIG_FLAG,
    "token_file": TOKEN_FILE_FLAG,
    "tls_cert": TLS_CERT_FLAG,
    "tls_key": TLS_KEY_FLAG,
    "tls_client_ca": TLS_CLIENT_CA_FLAG,
}
