// The store contract of docs/design.md on TieredStore: a real redis-server in front of the
// PostgreSQL fixture server in transactional mode.
#include "contract/contract_suite.hpp"
#include "tiered_support.hpp"

IDEM_CONTRACT_SUITE(tieredtest::TieredFactory, "[tiered]")
