/* dpbalance plugin ABI umbrella: the newest version. A host dlopen()s the library named by
 * DPB_PLUGIN and looks up DPB_PLUGIN_SYMBOL (trying newer versions first when there are
 * several); an engine's DP router looks up DPB_ROUTER_SYMBOL in the same library. */
#ifndef DPBALANCE_PLUGIN_H_
#define DPBALANCE_PLUGIN_H_

#include "dpbalance/plugin/dpbalance_plugin_v1.h"
#include "dpbalance/plugin/dpbalance_plugin_v2.h"
#include "dpbalance/plugin/dpbalance_router_v1.h"

/* The unversioned names below stay on v1 for source compatibility; new engines use the v2
 * names and look up DPB_PLUGIN_SYMBOL_V2 (dpbalance_plugin_v2.h). */
#define DPB_PLUGIN_SYMBOL_V2 "dpbalancePlugin_v2"
typedef dpbalancePlugin_v1_t dpbalancePlugin_t;
typedef dpbInitArgs_v1_t dpbInitArgs_t;
typedef dpbRequest_v1_t dpbRequest_t;
typedef dpbAccepted_v1_t dpbAccepted_t;
typedef dpbStats_v1_t dpbStats_t;
#define DPB_PLUGIN_SYMBOL "dpbalancePlugin_v1"
typedef dpbalanceRouter_v1_t dpbalanceRouter_t;
typedef dpbRouterArgs_v1_t dpbRouterArgs_t;
typedef dpbRankLoad_v1_t dpbRankLoad_t;
#define DPB_ROUTER_SYMBOL DPB_ROUTER_SYMBOL_V1
#define DPB_PLUGIN_DEFAULT_LIBRARY "libdpbalance.so"

#endif /* DPBALANCE_PLUGIN_H_ */
