// Umbrella header of the Stellar transport library.
#pragma once

#include "stellar/cm.hpp"
#include "stellar/status.hpp"
#include "stellar/verbs.hpp"
#include "stellar/version.hpp"
