// bench/kernel-trace-summary on a trace written here with known timings: three decode-graph
// launches (a leading copy 3 us before a kernel pair and a copy, fixed durations and idle gaps, 20
// us apart) plus one
// unrelated graph and a copy outside graphs, which the summary must leave out.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "tests/bench/bench_test_support.h"

namespace {

using moraine::bench_test::Scratch;
using moraine::bench_test::slurp;

TEST(KernelTraceSummary, SpansBusyIdleAndPerKernelTimesOfTheDecodeGraph) {
  Scratch s("moraine-kts-");
  const auto csv = s.dir / "trace.csv";
  {
    std::ofstream f(csv);
    f << "kind,name,start_ns,end_ns,stream,graph_id,graph_node_id,grid,block\n";
    long t = 1000;
    f << "kernel,_Z5setupv,10,500,7,9,1,1,1\n";   // another graph, launched once
    for (int launch = 0; launch < 3; ++launch) {
      f << "memcpy,HtoD 4," << t << "," << t + 500 << ",7,3,9,0,0\n";              // 0.5 us, then
      t += 500 + 3000;                                                            // 3 us before the kernels
      f << "kernel,_Z3fooPf," << t << "," << t + 5000 << ",7,3,10,8,256\n";       // 5 us
      t += 5000 + 2000;                                                           // 2 us idle
      f << "kernel,_Z3barPf," << t << "," << t + 3000 << ",7,3,11,8,256\n";       // 3 us
      t += 3000 + 500;                                                            // 0.5 us idle
      f << "memcpy,DtoH 8," << t << "," << t + 1000 << ",7,3,12,0,0\n";           // 1 us
      t += 1000;
      f << "memcpy,DtoH 607744," << t + 100 << "," << t + 600 << ",7,0,0,0,0\n";  // outside graphs
      t += 20000;
    }
  }
  const auto out = s.dir / "out.txt";
  const std::string cmd = std::string("python3 ") + MORAINE_SOURCE_DIR + "/bench/kernel-trace-summary " + csv.string() +
                          " --layers 2 > " + out.string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(out);
  const std::string text = slurp(out);
  // Per launch, from the first kernel: span 11.5 us, busy 9 us, idle 2.5 us; per layer (2): 5.75 /
  // 4.50 / 1.25. The median gap from a launch's last activity to the next launch's first: 20 us.
  EXPECT_NE(text.find("graph 3: 3 launches, 4 activities each"), std::string::npos) << text;
  EXPECT_NE(text.find("span      5.75 us per layer   busy      4.50   idle inside     1.25"), std::string::npos) << text;
  EXPECT_NE(text.find("(median)      20.0 us"), std::string::npos) << text;
  // foo: 5 us, no idle before, 2.5 us per layer; bar: 3 us after 2 us idle; the copy after 0.5 us.
  EXPECT_NE(text.find("foo"), std::string::npos) << text;
  EXPECT_NE(text.find("       1.0     5.00        3.00           2.50  43.5%"), std::string::npos) << text;
  // The leading copy: outside the span, 3.5 us from its start to the first kernel.
  EXPECT_NE(text.find("first kernel (median)       3.5 us"), std::string::npos) << text;
  EXPECT_NE(text.find("       1.0     3.00        2.00           1.50  26.1%"), std::string::npos) << text;
  EXPECT_NE(text.find("[memcpy] DtoH 8"), std::string::npos) << text;
  EXPECT_EQ(text.find("607744"), std::string::npos) << "a copy outside the decode graph was counted:\n" << text;
  EXPECT_EQ(text.find("setup"), std::string::npos) << "the other graph was counted:\n" << text;
}

TEST(KernelTraceSummary, RefusesATraceWithoutGraphLaunches) {
  Scratch s("moraine-kts-");
  const auto csv = s.dir / "trace.csv";
  std::ofstream(csv) << "kind,name,start_ns,end_ns,stream,graph_id,graph_node_id,grid,block\n"
                     << "kernel,_Z3fooPf,0,10,7,0,0,1,1\n";
  const auto out = s.dir / "out.txt";
  const std::string cmd = std::string("python3 ") + MORAINE_SOURCE_DIR + "/bench/kernel-trace-summary " + csv.string() +
                          " > " + out.string() + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_NE(slurp(out).find("no activity inside a CUDA graph"), std::string::npos) << slurp(out);
}

}  // namespace
