# The engine's unit tests (engine over the simulated channel, codecs,
# congestion control): they need only offload/ and the harness, so the
# offload-only build (STELLAR_OFFLOAD_ONLY, e.g. for aarch64) runs them too.
# Included from tests/CMakeLists.txt and from the top level.
find_package(GTest REQUIRED)
include(GoogleTest)
set(stellar_engine_tests_dir ${CMAKE_CURRENT_LIST_DIR}/unit)
add_executable(stellar_unit_tests ${stellar_engine_tests_dir}/engine_test.cpp ${stellar_engine_tests_dir}/cc_test.cpp
  ${stellar_engine_tests_dir}/wire_test.cpp ${stellar_engine_tests_dir}/scheduler_test.cpp)
target_link_libraries(stellar_unit_tests PRIVATE stellar_engine_harness stellar_offload GTest::gtest GTest::gtest_main ZLIB::ZLIB)
# Under qemu-user (the aarch64 build) listing and running the tests is slower.
gtest_discover_tests(stellar_unit_tests DISCOVERY_TIMEOUT 120 PROPERTIES LABELS unit)
