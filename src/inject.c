/* Fault injection countdown shared by the backends and the pager. */
#include "backend.h"

bool vp__inject_fail(vp__inject_t *inj) {
  if (!inj || inj->nth <= 0) return false;
  return --inj->nth == 0;
}
