"""One list of domains: the config, the data records and the verifiers read the same object."""

from megatron_sdpo.config.schema import DOMAINS as CONFIG_DOMAINS
from megatron_sdpo.data.records import DOMAINS as RECORD_DOMAINS
from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.rewards import DOMAINS as REWARD_DOMAINS


def test_the_three_domain_lists_are_one():
    assert CONFIG_DOMAINS is DOMAINS and RECORD_DOMAINS is DOMAINS and REWARD_DOMAINS is DOMAINS
    assert DOMAINS == ("math", "science", "tooluse", "code")
